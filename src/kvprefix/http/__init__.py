"""What every HTTP front end shares (server, router, Ray ingress): errors, auth and tenants, body reading,
host/origin guards, connection timeouts and request ids."""
