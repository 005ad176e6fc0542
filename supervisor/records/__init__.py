"""The run and its records: events, state.json, metrics, hooks, the run dir's lock."""
