"""kvroute: loadtest."""
