"""Decoder-side SWA bounded replay: which rows each request keeps (``row_selection``) and the
replay batch that runs the replay layers on them (``replay_batch``)."""
