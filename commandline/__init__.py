"""What the two command lines (``smart-triggerer``, ``dataset-bridge``) share: the errors a user can fix,
their exit codes and one-line messages, and the common flags. It imports nothing of ours."""
