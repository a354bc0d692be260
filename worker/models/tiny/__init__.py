"""Model files of kvroute-tiny (package data)."""
