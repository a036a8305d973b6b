"""How BatchSizeTuner and AccumulationTuner decide: the tuners' wing. The callbacks (``callbacks/tuners.py``) check
their arguments and call in from Lightning's hooks; everything they decide is here, one module per job.

- :mod:`.workflow`: a tuner's decision at fit start, as functions of the Trainer and the tuner: which sizes one
  epoch can run, then a resume's choice, the tuner's earlier one, a cached one, or a search; applied, every rank
  alike.
- :mod:`.tuner_settings`: :class:`~.tuner_settings.TunerSettings`, the arguments both tuners share, declared and
  checked once.
- :mod:`.search`: the step objects (``SizeSearch``, ``AccumulationSearch``: ``propose()`` / ``observe()`` /
  ``.result``), each trial judged by the spill rule, a close call measured again and its ``Margin`` kept.
- :mod:`.epoch`: what one epoch really runs (``EpochLength``), so which sizes can run.
- :mod:`.trials`: a trial, a few training steps inside the Trainer's own fit loop, measured and then undone.
- :mod:`.training_state`: the training state the trials copy to host memory and put back, each rank's shards.
- :mod:`.sharded_agreement`: the points between FSDP's collectives where sharded ranks agree on an out-of-memory
  error.
- :mod:`.trainer_hands`: the Trainer's other hands on the batch, the accumulation and the data: refused together
  with a tuner, or read.
- :mod:`.cache`: the result file (read defensively, written under a lock); :mod:`.cache_key`: what a cached choice is
  keyed on.
- :mod:`.adapt` and :mod:`.adapter`: ``MemGuard(on_spill="adapt")``, the same levers in the middle of a run: how many
  micro-batches each batch is split into, when to try fewer again and the record of every change (pure); the split
  inside the training step, redone after an out-of-memory error, and activation checkpointing for what is free now.

Pure, importing no Lightning (a test checks it): :mod:`.search`, :mod:`.epoch`, :mod:`.cache`,
:mod:`.tuner_settings` and :mod:`.adapt`. The others are the adapter: they read the Trainer, and Lightning's
internals only through :mod:`lightning_memguard._lightning.privates`. This package's face imports nothing.
"""
