"""Running scenarios: one case (``cases``) and the ``run``/``check`` commands over a scenario's
cases (``commands``)."""
