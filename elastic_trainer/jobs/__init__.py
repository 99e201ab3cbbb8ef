"""The built-in job (``elastic-train`` with no script): an image classifier trained with a
``TrainingSession``. It runs inside the workers, like any user's script.
"""
