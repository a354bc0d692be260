"""Routing policies, one per module; registered in ``router.scheduling.registry``."""
