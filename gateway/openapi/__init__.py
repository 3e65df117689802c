"""The OpenAPI 3.1 document of the public HTTP API, served at `GET /openapi.json`."""
