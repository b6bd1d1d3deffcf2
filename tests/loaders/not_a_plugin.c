/* A shared library without ferry_plugin_init, for the plugin host's error test. */
int not_a_plugin_answer(void) { return 42; }
