"""What every network connection of the gateway shares, written once.

``tls``: the one TLS context builder (backend calls, the Kubernetes API client, the serving
listener, dev tools). ``kubeconfig``: the one kubeconfig-format parser (backend credentials and
the cluster client). Below transport, sources and server; imports only ``gateway.errors``.
"""
