"""kvroute: worker."""
