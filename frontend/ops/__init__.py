"""The use-cases the transports call: the inference plane (one path for every prediction),
the management operations, token authorization, request parameters and ids."""
