"""Publishing an output to the Hugging Face Hub (the Hub *input* is ``sources.hub``).

- ``publish``: the ``upload`` command (verify, create the repo, upload the folder) and the remote check
  ``verify-manifest --remote`` shares with it;
- ``live``: ``pack --upload``, each shard sent as soon as it is final;
- ``card``: the model card written where an output has none.

The Hub's transport (the repo id, the token, retries, one-line errors) is ``transport``, shared with the Hub input.
"""
