"""A PAN 2 release's components, located and checked before any weight is read.

`locate` finds a folder or a Hugging Face repo (`resolve_components`); `layout` is where a pipeline index puts
each component; `checks` the cheap checks of each component against the models' own definitions; `hub_check`
the same checks on a hub repo before its weights are downloaded. Import the modules themselves: this package
imports nothing, so that `pan2 generate --help` stays torch-free.
"""
