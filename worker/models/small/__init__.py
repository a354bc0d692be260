"""Model files of kvroute-small (package data)."""
