"""Graph modes: the forward context seen by captured segments, capture sizes, CUDA graphs and
their CPU stand-in."""
