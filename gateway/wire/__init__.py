"""What every network connection of the gateway shares, written once.

``tls``: the one TLS context builder (backend calls, the Kubernetes API client, the serving
listener, dev tools). ``tls_stream``: the TLS connection stream of the serving listener and of
backend calls. ``kubeconfig``: the one kubeconfig-format parser (backend credentials and
the cluster client). Below transport, sources and server; imports only ``gateway.errors``.
"""

from __future__ import annotations

from typing import Final

# hyper-h2 remembers how each closed stream ended, by default for 2**16 streams per connection:
# ~11.5 MB for every long-lived HTTP/2 connection that has carried that many requests, inbound
# (a caller could make the gateway hold it on every connection) or to a backend. It needs them only
# to answer frames that arrive after a stream ended, which come within a round trip, and no
# connection closes this many streams in one.
H2_CLOSED_STREAMS_REMEMBERED: Final = 1_024
