"""kvroute: router."""
