"""Placeholder: the Numerics plugin backend lands with the plugin issue."""

from tensorboard.plugins import base_plugin

from tb_numerics import metadata


class NumericsPlugin(base_plugin.TBPlugin):
    plugin_name = metadata.PLUGIN_NAME

    def get_plugin_apps(self):
        return {}

    def is_active(self):
        return False

    def frontend_metadata(self):
        return base_plugin.FrontendMetadata(tab_name="Numerics")


class NumericsLoader(base_plugin.TBLoader):
    def load(self, context):
        return NumericsPlugin(context)
