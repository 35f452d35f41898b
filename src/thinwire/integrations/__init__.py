"""thinwire inside the training frameworks people already use.

Each module is an optional extra, imported only when used:

- :mod:`thinwire.integrations.lightning`: a Lightning ``Callback``
  (``pip install thinwire[lightning]``);
- :mod:`thinwire.integrations.accelerate`: one call after ``accelerator.prepare``
  (``pip install thinwire[accelerate]``);
- :mod:`thinwire.integrations.transformers`: a ``TrainerCallback`` for the Hugging Face
  ``Trainer`` (``pip install thinwire[transformers]``).

Each registers thinwire's DDP hook once the framework has built its DDP model, logs the
bytes each step sent through the framework's own logging, and keeps every rank's
compressor state (residuals, momenta, warm starts) in the framework's own checkpoints:
frameworks write rank 0's copy only, so the state saved is the all-ranks one
(:meth:`thinwire.GradientExchange.full_state_dict`) from which every rank takes its part.
"""
