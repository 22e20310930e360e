"""KVzap scorers shipped with the package (see README.md here); found by model identity."""
