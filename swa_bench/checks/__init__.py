"""The checks: the SPEC's rules restated apart from the replay code (``oracle``), tensor
comparison (``comparison``) and tolerances (``tolerance``), the equivalences E1-E5
(``equivalence``), top-k selections judged apart (``selection``), the approximation figures
(``approximation``), task accuracy per policy (``tasks``) and the checks across ranks
(``parallel``). Import from the modules: this package stays light so the scenario schema can read
the tolerance table without loading the engine."""
