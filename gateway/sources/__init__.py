"""Live inputs of a running gateway: the configuration directory, TLS files and namespace labels.

``configdir`` polls the configuration directory (and any other files, such as the serving
certificate) and swaps in a new ``Snapshot`` only when it validates (CFG-25). ``namespaces`` answers
"what are the labels of namespace N" for namespaceSelector matching, from the configuration files or
from a list+watch of the cluster (GW-01), using the small API client in ``kube``.

These modules sit beside the server in the stack: they may use trio, but nothing below the server
imports them; the dispatcher only sees a callable returning labels.
"""
