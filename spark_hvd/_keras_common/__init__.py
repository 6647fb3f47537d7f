"""What the Keras and TensorFlow bindings share, one floor below both: the Keras ``DistributedOptimizer`` wrapper
(``optimizer``, given each binding's collectives) and Keras variables' broadcast and elastic state (``state``)."""
