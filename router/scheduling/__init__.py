"""Worker selection: shared types, policies (plugins), the cost model and the Scheduler."""
