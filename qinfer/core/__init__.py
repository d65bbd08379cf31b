"""The bottom layer: the model facts every stage shares (GGUF names and keys, architectures, model specs, KV
policies, vocabularies, the one UserError). It imports no other package of the project.
"""
