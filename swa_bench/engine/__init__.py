"""The runtime: engine configuration (``config``), the per-step plan (``dispatch``), the step
runner (``engine``) and a step's inputs (``step_inputs``). Import from the modules: this package
stays light so that scenario validation can read ``config`` without loading the model."""
