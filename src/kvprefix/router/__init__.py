"""Routing requests over engine replicas: policies (served by the HTTP router, replayed by the planner)."""
