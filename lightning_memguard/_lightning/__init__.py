"""The library's Lightning-facing layer, private, below the callbacks (``callbacks/``) and the tuners' wing
(``tuning/``), which both use it and neither of which it imports:

- :mod:`.privates`: every Lightning internal the library touches, named once, grouped by what it touches;
- :mod:`.batches`: the samples in a training batch, loader by loader, the model's inputs in one, and its split;
- :mod:`.loaders`: the train loader built again, the random number generators kept, the first batch read;
- :mod:`.agreement`: the ranks' figures gathered, and a stop voted without a per-step sync;
- :mod:`.spill_checkpoint`: the checkpoint written when a spill stops the run.
"""
