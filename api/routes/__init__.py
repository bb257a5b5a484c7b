"""HTTP routes: thin functions that delegate to the service modules in `api/`."""
