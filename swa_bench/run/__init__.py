"""Running scenarios, and the command bodies the CLI calls: one case (``cases``), the ``run`` and
``check`` commands over a scenario's cases (``commands``), ``kernels``, ``export`` and ``compare``,
where a run writes (``folder``), ``--gpus`` workers (``shards``) and the torchrun entry
(``parallel``); ``errors`` is what a body refuses."""
