"""Developer tools that are not part of the request path: sample backend webhooks for tests, the demo
and the load tests. Nothing in the gateway proper imports this package."""
