"""A card with sysmem fallback emulated on any device (:mod:`.emulator`), the small models the demo and the sweep
train (:mod:`.models`) and a step timer (:mod:`.timing`): what the commands run on, and what users' tests import as
:mod:`lightning_memguard.testing`."""
