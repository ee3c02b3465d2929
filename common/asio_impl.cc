// The one translation unit that compiles Asio and Beast (separate compilation): every other file
// includes only their declarations, which cuts the build time of each HTTP file by about a third.
#include <boost/asio/impl/src.hpp>
#include <boost/asio/ssl/impl/src.hpp>
#include <boost/beast/src.hpp>
