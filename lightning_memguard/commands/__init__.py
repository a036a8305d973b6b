"""The ``memguard`` command (:mod:`.cli`: its arguments, then one module per sub-command): :mod:`.demo` (``make demo``),
:mod:`.doctor` (platform facts and the fallback verdict), :mod:`.sweep` (one short run per batch size) and :mod:`.plan`
(the accumulation tuner's search for one effective batch)."""
