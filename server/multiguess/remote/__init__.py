"""Remote drafting: the draft model in its own pods, serving the target pods of a deployment.

``protocol`` is the binary wire format (pure), ``sessions`` the draft server's per-session
bookkeeping (pure), ``service`` drives a local drafter from decoded messages, ``server``
puts it behind a WebSocket endpoint, and ``client.RemoteDrafter`` is the target side's drafter.
"""
