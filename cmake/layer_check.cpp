// Empty: a layer's check library is the layer's archive linked whole (CMakeLists.txt, crosskv_layer).
