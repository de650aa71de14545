#include "fit/context.hpp"

#include "fit/grid.hpp"

namespace crosskv {

Comm& Context::readers() const { return grid ? *grid->readers : comm; }

}  // namespace crosskv
