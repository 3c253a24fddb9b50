"""Ray Serve: N engine replicas as one deployment, routed by the same policy objects and ledger as `kvprefix
route` (docs/router.md). ``options`` (the `kvprefix serve --ray` options) imports no Ray; every other module here
imports it at its top, and nothing outside this package imports them."""
