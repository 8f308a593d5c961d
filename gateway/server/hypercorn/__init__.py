"""The gateway's inbound HTTP server: hypercorn's protocol classes, adjusted, behind one seam.

hypercorn is the inbound server: it contributes HTTP/2 (``H2Protocol``), the ASGI stream glue
(``HTTPStream``) and ``Config``. The gateway owns the rest of the way from the socket to the app:
the accept loop, TLS, the per-connection server, the request queue and the HTTP/1.1 fast path.
Everything that touches hypercorn lives in this package, one module per class of hypercorn's it
replaces, and each module's docstring says why (a crash fix, a limit, or a measured speed-up,
with where the measurement is) and which byte-level test drives it (scripted bytes and frames
over real sockets):

==================  ===========================  ==============================================
module              replaces (hypercorn)         why
==================  ===========================  ==============================================
``listener``        ``worker_serve``             connection bound, accept back-off, TLS context
                                                 per accept, the gateway's TLS stream, accepts
                                                 on the plain socket (speed)
``handshake``       ``TCPServer``'s handshake    pending connections: no TLS state before the
                                                 ClientHello, own bound (evicts the oldest),
                                                 own deadline
``tcp_server``      ``TCPServer``                crash fix (Busy on send), deadlines on
                                                 heads/bodies/writes, prompt release, no
                                                 reference cycles left when closed
``watchdog``        ``TCPServer``'s idle task    header and idle deadlines; one timer task for
                                                 all connections (speed)
``protocol``        ``ProtocolWrapper``          builds the classes below for this listener's
                                                 connections only (no process-wide patch)
``http11``          ``H11Protocol``              HTTP/1.1 fast path, one write per reply (speed)
``http_stream``     ``HTTPStream`` (HTTP/1.1)    the scope without an intermediate event (speed)
``http2``           ``H2Protocol``               two crash fixes, control-frame budget, a
                                                 stream over the limit refused alone
``task_group``      ``TaskGroup``                request queue, body/write deadlines, app inline
``request_queue``   the per-request channel      disconnect by callback (speed), body deadline
``config``          ``Config``                   inbound runtime for every connection; Date
                                                 header once a second (speed)
``version``         --                           refuses hypercorn/h11 releases not verified
==================  ===========================  ==============================================

How the rest of the gateway uses it:

- ``gateway.server.serve`` calls ``listener.serve_inbound(app, config.server_config(...), ...)``
  and, before anything else, ``version.check_versions()``. Nothing in hypercorn's own modules is
  reassigned: the gateway's classes are passed explicitly from its own accept loop.
- The application (``gateway.server.app``) imports nothing from here. What the server tells it
  beyond ASGI travels in the request's scope, as declared in ``gateway.server.extensions``
  (``scope["extensions"]["webhook-gateway.disconnect"]``).
- Limits are defined in ``gateway.server.limits`` (the numbers, the connection registry, the
  HTTP/2 control-frame budget: pure bookkeeping) and enforced here: accepting in ``listener``,
  per connection in ``tcp_server``/``watchdog``, per HTTP/2 frame in ``http2``, per request in
  ``task_group``/``request_queue``.

pyproject.toml's import-linter contracts keep it so: the application and the fast path's parser
do not import this package, and nothing outside it imports hypercorn.

This ``__init__`` imports nothing, so that ``version`` can be checked without loading hypercorn
(the ``--workers`` supervisor does that before it starts any worker).
"""
