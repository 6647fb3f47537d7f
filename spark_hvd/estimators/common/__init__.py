"""What the torch, Keras and Lightning estimators share: the params and their mixins (``params.py``), ``fit``'s
driver half (``fit.py``), the fitted model's ``transform`` (``model.py``), Spark ML persistence, the rank's run
and its data, checkpoints and their retention, MLflow, TensorBoard, export and serving. Nothing here imports a
framework sub-package (``torch/``, ``keras/``, ``lightning/``)."""
