"""What the main-job CLIs share: flags, the training loop, logs, checkpoints, metrics.

Modules (one idea each):

- :mod:`.flags` -- the common flags (:func:`~.flags.common_parser`); :mod:`.args` -- their validation
  (:func:`~.args.run_config`), run before any process starts.
- :mod:`.config` -- the :class:`~.config.RunConfig` the validation returns: typed, frozen,
  in parts (pipeline, data, train, codec, delta, log, and the job's own options).
- :mod:`.codecs` -- compression flags -> codec specs (boundaries, DDP gradients), and the
  named boundary settings (:data:`~.codecs.SETTINGS`).
- :mod:`.job` -- the :class:`~.job.Job` interface; :mod:`.vision` (MobileNetV2 on
  CIFAR) and :mod:`.nlp` (encoders on GLUE) implement it.
- :mod:`.engine` -- one rank's training step: the compressed pipeline or DDP.
- :mod:`.loop` -- :func:`~.loop.main` (a main-job CLI's body: parse into a run config, run) and
  :func:`~.loop.run`: launch (local spawn or torchrun), epochs, evaluation, logs,
  checkpoints.
- :mod:`.report` -- what rank 0 logs and prints of a run (progress, boundary entries, epoch records, summary).
- :mod:`.runlog` -- JSON-lines records and their readable form; :mod:`.checkpoint`;
  :mod:`.metrics` (GLUE/CIFAR metrics).
- :mod:`.compare` -- ``--compare-to``: the same command under named settings, side by side.
- :mod:`.sweep` -- a main job run for a few steps under each boundary codec, one
  traffic table (``bandwidth/test_cv_bandwidth.py``, ``bandwidth/test_nlp_bandwidth.py``).
"""
