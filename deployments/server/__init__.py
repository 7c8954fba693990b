"""The replica: its start (``start``), its lifecycle (``replica.LLMServer``), its HTTP front
(``http``, ``routes``, ``responses``, ``api``) and its metrics (``metrics``)."""
