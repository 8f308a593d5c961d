"""Load tests for webhook-gateway: a backend fleet, the gateway as a separate process, and a load
generator that speaks what kube-apiserver speaks, with a direct-to-backend baseline in the same run.

Run ``python -m loadtests --help``; see ``loadtests/README.md``.
"""
