"""One loaded model: its handler found and initialised (``loader.py``), adapted where it needs
it (``sagemaker.py``: the SageMaker toolkit's handler service; ``workflow_functions.py``: a
workflow's function node), its steps timed (``phases.py``), and each batch planned into runs,
run through the handler and merged (``model_service.py``)."""
