"""ANDREA: small GPT training that survives crashes, pivots and audit forks. No Prefect in here."""
