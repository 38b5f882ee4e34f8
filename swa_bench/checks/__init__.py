"""The checks: tensor comparison (``comparison``), the equivalences E1-E5 (``equivalence``) and the
approximation figures (``approximation``). Import from the modules: this package stays light so
the scenario schema can read the tolerance table without loading the engine."""
