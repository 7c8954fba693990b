"""Names that code outside the project calls or reads, so vulture's dead-code pass keeps them.

Each line uses one name; the comment says who calls it.
"""
# ruff: noqa: F821  (the names are listed, never run)

_.model_config  # pydantic reads each model's configuration by this name
_._one_device_each  # pydantic runs @model_validator methods
_._aligned  # pydantic runs @model_validator methods
_.record_autoscaling_stats  # Ray Serve calls it on every replica (custom autoscaling metrics)
_.http_error  # FastAPI calls @app.exception_handler functions
hook  # Ray runs it in every worker: runtime_env's worker_process_setup_hook names it
__getattr__  # Python calls a module's __getattr__ for a name it lacks (lazy exports)
_.pre_tokenizer  # the tokenizers library reads the attributes a test tokenizer sets
_.post_processor
_.architectures  # transformers reads config.architectures when it saves a model
pytestmark  # pytest reads a test module's marks by this name
ray_instance  # a pytest fixture: tests name it to have Ray running
_.do_GET  # http.server calls a request handler's do_<METHOD> and log_message, reads protocol_version
_.do_HEAD
_.do_POST
_.log_message
_.protocol_version
_.disable_nagle_algorithm  # socketserver's StreamRequestHandler reads it to set TCP_NODELAY
_.daemon_threads  # socketserver reads its server class's settings by these names
_.allow_reuse_address
_.should_exit  # uvicorn's Server polls it to stop (tests' helpers_http serves an app with it)
_.extra_repr  # torch's Module.__repr__ calls it by name
