"""The outbound uplink: a gateway on a VPS, the guard at home, one mutual-TLS HTTP/2 connection
that the home side dials out.

* :mod:`gateway.uplink.link`: one HTTP/2 connection (the h2 library), bounded streams, flow control,
  keep-alive pings; shared by both ends.
* :mod:`gateway.uplink.hub`: the gateway's end (TLS server, HTTP/2 client): it accepts the one
  pinned home connection and forwards agent requests over it.
* :mod:`gateway.uplink.home`: the home end (TLS client, HTTP/2 server): it dials the gateway with
  backoff and hands each request to the guard's Unix socket.
* :mod:`gateway.uplink.relay`: the sealed payloads uploaded at the gateway, offered home over the
  link and taken into the home's payload store (checked, audited), then removed at the gateway.
* :mod:`gateway.uplink.homestatus`: the home side's status file, read by ``uomp status`` and the
  dashboard (standard library only).
* :mod:`gateway.uplink.certs`: the dedicated uplink CA (kept at home), the two certificates and
  their pins, and the VPS's data directory.

``gateway.remote`` imports only ``hub`` (and what it imports); this package never imports
``gateway.guard``: the home side talks to the guard through its socket like the gateway does.
"""
