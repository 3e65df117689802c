"""The HTTP edge: connections, middlewares, CORS, the SSE writer, errors on the wire, follow
tokens and a replica's drain."""
