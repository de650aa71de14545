// A layer's check program: its archive linked whole (CMakeLists.txt, crosskv_layer); any undefined reference fails.
int main() { return 0; }
