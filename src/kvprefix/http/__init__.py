"""What every HTTP front end shares (the server, the router, the Ray ingress): errors, auth and tenants, body
reading, host/origin guards, connection timeouts and request ids. Imports nothing of ours above it."""
