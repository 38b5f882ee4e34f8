"""Decoder-side SWA bounded replay: kept rows, the replay batch and the replay layers."""
