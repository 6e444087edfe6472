"""The command lines, run in the operator's shell: ``smart-triggerer`` (``main``), its ``airflow
smart-triggerer`` twin (``provider``), ``status``; the errors and flags ``dataset-bridge`` shares."""
