"""What each unit trains on: the activation cache, the float and quantized streams, the float
reference, each process's share of the data, a unit's values rows first, its training batches, the
held-out batches and its losses."""
